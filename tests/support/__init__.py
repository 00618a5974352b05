"""Helpers shared by test files (one copy each)."""
