"""Scripts the tests run in a fresh process (see `tests.helpers.run_script`), and
the modules they share with the tests."""
