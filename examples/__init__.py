"""Example scripts (run them as scripts); a package so that the tests can import examples.lm and examples.train."""
