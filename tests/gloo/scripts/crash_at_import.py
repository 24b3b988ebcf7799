import leto  # noqa: F401

raise RuntimeError("this script is broken at import")
