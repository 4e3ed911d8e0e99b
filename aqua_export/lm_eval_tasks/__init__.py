"""lm-evaluation-harness task files of the offline group aqua_local (YAML) and their items (aqua_tasks.py)."""
