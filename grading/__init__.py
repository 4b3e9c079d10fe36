"""Grading shared by bench/ and training/: grading/checker.py (whole-word answer matching, eval-set reading)."""
