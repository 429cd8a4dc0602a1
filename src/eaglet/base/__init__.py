"""eaglet.base: The ground every package stands on: the errors that refuse an artifact by name
(artifacts), atomic writes and JSON / text / Parquet files (files), safetensors files (tensors),
recorded digests and manifests (digests), conversation files and their row checks (conversations),
settings files and JSON arguments (settings_files), a stage's logging (logs), what this machine can
run (capability), job records (job_records), the packaged data sets (datasets: ShareGPT,
MT-Bench, HumanEval, CHAMP), and the library versions in each stage's key (library_versions).
"""

# The packages this one may import (tests/workflow/test_layering.py reads it): nothing above it.
MAY_IMPORT = ()
