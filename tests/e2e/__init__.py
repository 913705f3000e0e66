"""End-to-end tests against a real tritonserver."""
