"""``python -m eaglet.export.contract DIR --identity ID.json [--trained ...] [--vllm] ...``: the
contract on one exported directory (eaglet.export.contract.contract.main; its --help says the rest)."""

from eaglet.export.contract.contract import main

main()
