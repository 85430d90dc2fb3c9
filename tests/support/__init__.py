"""Helpers the tests of every app share (import them from here, never from a conftest module)."""
