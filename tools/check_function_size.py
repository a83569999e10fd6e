#!/usr/bin/env python3
"""Fails on functions longer than a limit (default 100 lines, the def line to the last line of its body).

    python3 tools/check_function_size.py [--max N] PATH...

PATH: files or directories (searched recursively). Prints each offender as `path:line name N lines` and exits 1
if there is any. Python files are read with the standard library's ast (decorators not counted; nested
functions and methods counted on their own, as `Class.method` / `outer.inner`, and inside their parent too).
C++ and CUDA files by a brace-matching heuristic (cxx_functions). Other languages: add a reader `<language>_functions(path)` returning (name, line, length) tuples and map the
file suffixes to it in READERS.
"""
import argparse
import ast
import os
import re
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


_CXX_TOKEN = re.compile(r'//[^\n]*|/\*.*?\*/|R"(?P<d>[^(]*)\(.*?\)(?P=d)"|"(?:\\.|[^"\\\n])*"|'
                        r"'(?:\\.|[^'\\\n])*'|[{};]", re.S)
_CXX_CONTROL = re.compile(r"\b(if|for|while|switch|catch|do|else|return)\s*(\(.*\))?\s*$", re.S)
_CXX_SIGNATURE_END = re.compile(r"\)\s*(const|noexcept|override|final|mutable|volatile|&|&&|\s|->\s*[\w:<>,\s*&]+)*$",
                                re.S)


def cxx_functions(path):
    """(name, line, length) of each function body in a C++ / CUDA file that is not inside another function
    (lambdas and local classes count toward their function). A heuristic for clang-formatted code: a brace
    opened outside any function whose header (the code since the last ';', '{' or '}') ends in a parameter
    list, and is no control statement or initializer, opens a function. Constructors with member
    initializers are not seen."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    found, stack = [], []  # stack: (is_function, name, line) per open brace
    last = 0  # just past the last ';', '{' or '}' outside comments and literals
    for m in _CXX_TOKEN.finditer(text):
        tok = m.group(0)
        if tok not in ("{", "}", ";"):
            continue
        if tok == "{":
            raw = text[last:m.start()]
            header = _CXX_TOKEN.sub(lambda t: "" if t.group(0)[:2] in ("//", "/*") else t.group(0), raw).strip()
            is_function = (not any(f for f, _, _ in stack) and "(" in header and not header.endswith("=")
                           and _CXX_SIGNATURE_END.search(header) is not None and not _CXX_CONTROL.search(header))
            names = re.findall(r"([~\w:]+|operator\S+)\s*\(", header) if is_function else []
            start = text.count("\n", 0, last + len(raw) - len(raw.lstrip())) + 1
            stack.append((is_function, names[0] if names else "?", start))
        elif tok == "}" and stack:
            is_function, name, start = stack.pop()
            if is_function:
                found.append((name, start, text.count("\n", 0, m.start()) + 2 - start))
        last = m.end()
    return found


# File suffix -> reader of (name, line, length) tuples.
READERS = {".py": python_functions, ".cpp": cxx_functions, ".cu": cxx_functions, ".cuh": cxx_functions,
           ".hpp": cxx_functions, ".h": cxx_functions}


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
