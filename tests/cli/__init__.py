# A package, so that this directory's conftest.py is `cli.conftest` and never shadows tests/conftest.py.
