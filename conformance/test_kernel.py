"""The test items of the pytest plugin (see :mod:`conformance.pytest_plugin`).

Collected by ``pytest --pyargs conformance --attn-kernel MODULE:FUNCTION``; without
``--attn-kernel`` the single item is skipped.
"""


def test_case(attn_case):
    if attn_case is not None:
        attn_case.run()
