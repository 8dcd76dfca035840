"""End-to-end recipes built from the project's tasks and models."""
