#!/usr/bin/env python3
"""docs:links: every relative link of README.md and docs/*.md names a file that exists and, when it
has an #anchor into a Markdown page, a heading of that page (GitHub's anchors: lower case,
punctuation dropped, spaces as hyphens, -1, -2, ... for repeated headings). Links inside code
blocks and to other sites are not checked.

    check_links.py <source dir>
"""
import glob
import os
import re
import sys

CODE = re.compile(r"^```.*?^```", re.S | re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} +(.*?) *#*$", re.M)


def anchor_of(heading):
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path, cache={}):
    if path not in cache:
        seen, found = {}, set()
        with open(path, encoding="utf-8") as f:
            text = CODE.sub("", f.read())
        for m in HEADING.finditer(text):
            a = anchor_of(m.group(1))
            seen[a] = seen.get(a, -1) + 1
            found.add(a if seen[a] == 0 else f"{a}-{seen[a]}")
        cache[path] = found
    return cache[path]


def main(root):
    pages = [os.path.join(root, "README.md")] + sorted(glob.glob(os.path.join(root, "docs", "*.md")))
    bad = []
    for page in pages:
        with open(page, encoding="utf-8") as f:
            text = CODE.sub("", f.read())
        for m in LINK.finditer(text):
            target = m.group(1)
            if re.match(r"[a-z][a-z0-9+.-]*:", target):
                continue  # https:, mailto: ...
            path, _, anchor = target.partition("#")
            resolved = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            where = os.path.relpath(page, root)
            if not os.path.exists(resolved):
                bad.append(f"{where}: ({target}) names {os.path.relpath(resolved, root)}, which does not exist")
            elif anchor and resolved.endswith(".md") and anchor not in anchors(resolved):
                bad.append(f"{where}: ({target}): {os.path.relpath(resolved, root)} has no heading "
                           f"whose anchor is '{anchor}'")
    if bad:
        print("expected every relative link to resolve, found:\n  " + "\n  ".join(bad))
        return 1
    print(f"links of {len(pages)} pages resolve")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
