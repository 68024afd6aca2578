"""What every executed example in the docs starts from.

Shared by ``conf.py`` (Sphinx's doctest builder) and ``tests/test_docs.py`` (the same
blocks in the normal pytest run), so both run the pages in the same namespace.
"""

GLOBAL_SETUP = """\
import math
import array_api_strict as xp
import attn_ref
"""

# Options applied to every block: whitespace in printed arrays is not significant.
OPTION_NAMES = ("ELLIPSIS", "NORMALIZE_WHITESPACE")
