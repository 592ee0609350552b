"""Eval and sample: the student against the teacher's cached outputs, and images from prompts."""
