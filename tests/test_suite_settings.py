"""The suite's own settings (tests/conftest.py): XLA flags for fast CPU compiles, asked of
the installed jaxlib before they are set, since an unknown flag aborts the process."""

from conftest import CPU_XLA_FLAGS, _xla_takes


def test_the_flag_probe_refuses_an_unknown_xla_flag_and_takes_a_known_one():
    """An unknown flag is refused (the suite then sets -O0 alone), -O0 is taken."""
    assert not _xla_takes(["--xla_bpt_no_such_flag=true"])
    assert _xla_takes([CPU_XLA_FLAGS[0]])
