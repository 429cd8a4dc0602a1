"""eaglet.workflow: What drives a run, on top of everything: the config resolved once at parse time
(resolve) after its checks (checks) and those of the environments it needs (environments), how
settings become a rule's params (params), what a rule reads
from outside the run (inputs), the training job's wiring (train_job), the code each rule lists as
inputs (code_inputs), the table `make run` ends with (summary), and the stage table of README.md and
docs/architecture.md, read from the rule files (stages), and Snakemake's output cache made safe for
runs sharing it at the same moment (shared_cache). Only the Snakefile and the command line
import it; no stage does.
"""

# The packages this one may import (tests/workflow/test_layering.py reads it): nothing above it.
MAY_IMPORT = ("base", "target", "hidden", "drafter", "engines", "planner",
              "data", "generate", "features", "train", "export", "eval", "learning_curve", "report")
