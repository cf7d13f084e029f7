"""Exercise mode: the course's own functions as graded assignments, and a museum of real bugs.

    python -m common.exercises list                         # every exercise, one line each
    python -m common.exercises make --chapter 02 --out DIR  # a student copy with the bodies removed
    python -m common.exercises grade --chapter 02 [--repo DIR]
    python -m common.exercises bug list | bug ID --out DIR  # plant one real bug in a copy
    python -m common.exercises wrong list | wrong --check   # realistic wrong answers: each must be graded wrong
    python -m common.exercises copies [--chapter NN]        # each chapter's copy fails only on its open exercises

The grader runs the course's own tests of each piece (see `run_tests.py`); nothing here knows a
right answer that the tests do not already check.
"""
