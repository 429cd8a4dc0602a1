"""A stage's logging: to stderr and its log file, the exception that ends it included, with the chatty
third-party loggers silenced."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path


def setup_logging(log_file: str | os.PathLike | None = None, level: int = logging.INFO) -> None:
    """Log to stderr, and to ``log_file`` too when given. Silences chatty third-party loggers.
    With a log file, an exception that ends the stage goes into it too (the refused file, the
    cache entry and its evict command are in the stage's log, not only in Snakemake's output)."""
    global _previous_excepthook
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_file:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(log_file))
        if sys.excepthook is not _log_uncaught:
            _previous_excepthook = sys.excepthook
            sys.excepthook = _log_uncaught
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        handlers=handlers, force=True)
    quiet_third_party()


_previous_excepthook = sys.excepthook


def _log_uncaught(exc_type, exc, tb) -> None:
    """sys.excepthook: the exception into the log files (stderr gets the usual traceback)."""
    if not issubclass(exc_type, KeyboardInterrupt):
        rec = logging.LogRecord("eaglet", logging.ERROR, __file__, 0, "%s: %s", (exc_type.__name__, exc),
                                (exc_type, exc, tb))
        for h in logging.getLogger().handlers:
            if isinstance(h, logging.FileHandler):
                h.handle(rec)
    _previous_excepthook(exc_type, exc, tb)


def quiet_third_party() -> None:
    """The tokenizer floods the log with warnings (the seed run's lesson): keep them out. Before
    transformers is imported, by the variables it reads at import (a stage that never loads a model
    or a tokenizer, most of the DAG's small ones, does not pay transformers' ~1 s import for this);
    after, by its own calls (eaglet.target.load calls this again once it has imported it)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    for name in ("transformers", "transformers.tokenization_utils_base", "gguf", "accelerate"):
        logging.getLogger(name).setLevel(logging.ERROR)
    if "transformers" not in sys.modules:
        return
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except Exception:  # transformers half-imported or broken in this environment
        pass
