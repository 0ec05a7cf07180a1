"""What tests share: waiting on state (`wait`), and later the fixtures and references. Nothing here is imported from
server/ as a reference: a test's oracle lives with the tests."""
