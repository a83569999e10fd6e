#!/usr/bin/env python3
"""Fails on functions longer than a limit (default 100 lines, the def line to the last line of its body).

    python3 tools/check_function_size.py [--max N] PATH...

PATH: files or directories (searched recursively). Prints each offender as `path:line name N lines` and exits 1
if there is any. Python files are read with the standard library's ast (decorators not counted; nested
functions and methods counted on their own, as `Class.method` / `outer.inner`, and inside their parent too).
Other languages: add a reader `<language>_functions(path)` returning (name, line, length) tuples and map the
file suffixes to it in READERS.
"""
import argparse
import ast
import os
import sys

LIMIT = 100


def python_functions(path):
    """(qualified name, def line, length in lines) of every function and method in the Python file at path."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    found = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                found.append((name, child.lineno, child.end_lineno - child.lineno + 1))
                visit(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


# File suffix -> reader of (name, line, length) tuples.
READERS = {".py": python_functions}


def source_files(paths):
    """The files under paths (files given by name are kept whatever their suffix, if a reader takes it)."""
    for p in paths:
        if os.path.isdir(p):
            for root, dirs, files in os.walk(p):
                dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
                for f in sorted(files):
                    if os.path.splitext(f)[1] in READERS:
                        yield os.path.join(root, f)
        else:
            yield p


def offenders(paths, limit=LIMIT):
    """(path, line, name, length) of every function over limit lines in paths."""
    out = []
    for path in source_files(paths):
        reader = READERS.get(os.path.splitext(path)[1])
        if reader is None:
            raise SystemExit(f"check_function_size: no reader for {path} (known: {', '.join(sorted(READERS))})")
        out += [(path, line, name, n) for name, line, n in reader(path) if n > limit]
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max", type=int, default=LIMIT, help="the most lines a function may have (%(default)s)")
    parser.add_argument("paths", nargs="+", help="files or directories")
    args = parser.parse_args(argv)
    bad = offenders(args.paths, args.max)
    for path, line, name, n in bad:
        print(f"{path}:{line} {name} {n} lines")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
