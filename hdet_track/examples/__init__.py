"""Small, readable training jobs that show HDET end to end (templates for your own)."""
