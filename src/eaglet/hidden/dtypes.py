"""How hidden states are stored on disk: the config's dtype names and the bytes one stored token
takes. Read by extraction and the store (eaglet.hidden.store), and by the planner's storage
decision (eaglet.planner.storage), which must agree with them to the byte."""

from __future__ import annotations

# Config spelling -> storage dtype name written into index.json.
DTYPES = {"bfloat16": "bfloat16", "float32": "float32", "fp8": "float8_e4m3fn",
          "float8_e4m3fn": "float8_e4m3fn"}


def storage_dtype(name: str) -> str:
    if name not in DTYPES:
        raise ValueError(f"extract.dtype: {name!r} not one of {sorted(DTYPES)}")
    return DTYPES[name]


def bytes_per_token(dtype: str, hidden_size: int) -> int:
    """Disk bytes per stored token: (3 aux + 1 final) x H values, plus fp8 scales, the id, the loss
    mask and the target's full-vocabulary statistics (log-sum-exp float32, argmax int32)."""
    d = storage_dtype(dtype)
    elem = {"bfloat16": 2, "float32": 4, "float8_e4m3fn": 1}[d]
    scales = 4 * 4 if d == "float8_e4m3fn" else 0
    return 4 * hidden_size * elem + scales + 4 + 1 + 8
