"""The error a constrained job ends with (torch- and llguidance-free, so ``engine.job`` can
import it without loading llguidance)."""


class FilterError(ValueError):
    """A job's grammar refused a token or failed, or its banned strings cannot be avoided:
    the job ends with an "error" result; the others go on."""
