"""eaglet: a Snakemake workflow that turns a target LLM into a trained EAGLE-3 drafter."""

__version__ = "0.1.0"
