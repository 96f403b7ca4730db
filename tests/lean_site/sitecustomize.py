"""Processes the tests launch start without the optional packages that Keras imports at `import tensorflow`
when they are installed: matplotlib, IPython, scikit-learn and SciPy, 1.4 of the 4.4 CPU seconds of every
start. The test extra installs them for a few tests of their own (trainer.plot, notebooks, the examples on
scikit-learn's data, reference metrics); the hundreds of trainings the suite launches need none of them, as
a user's install without the extras. tests/conftest.py puts this folder on PYTHONPATH and names the hidden
packages in TRAINER_TESTS_HIDDEN for every process a test starts; a test whose process needs one of them
leaves that variable out (tests/support.py: `subprocess_env(full=True)`)."""

import os
import sys


class _Hidden:
    """Finds the hidden packages as missing, saying why."""

    def __init__(self, names: set[str]):
        self.names = names

    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] in self.names:
            raise ModuleNotFoundError(
                f"{fullname} is hidden from processes the tests start (tests/lean_site); "
                "a test that needs it starts its process with subprocess_env(full=True)",
                name=fullname,
            )
        return None


_names = {n for n in os.environ.get("TRAINER_TESTS_HIDDEN", "").split(",") if n}
if _names:
    sys.meta_path.insert(0, _Hidden(_names))
