"""The recipes that ship with wandistill: installed as the package `wandistill.recipes`.

pyproject.toml maps this folder into the package (`package-dir`), so `wandistill demo` and recipe
names (`wandistill train tiny ...`) work from any directory and from a wheel; this file makes the
mapping a regular package, which editable installs need. List them: `wandistill recipes`.
"""
