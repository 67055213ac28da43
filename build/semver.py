"""Semantic-version precedence of Go module versions, for the build scripts' python3 snippets.

key(v) orders v1.2.3 above its pre-releases (v1.2.3-rc.2, and the pseudo-version
v1.2.3-0.<date>-<commit> that comes before it), compares pre-release identifiers numerically where
they are numbers (rc.10 above rc.2) and ignores +build metadata (+incompatible), as Go does.
"""


def key(v):
    v = v[1:].split("+")[0]
    main, _, pre = v.partition("-")
    nums = tuple(int(x) for x in main.split("."))
    if not pre:
        return (nums, 1, ())
    return (nums, 0, tuple((0, int(i), "") if i.isdigit() else (1, 0, i) for i in pre.split(".")))
