"""semver: semantic versions, their precedence, and npm-style ranges."""

from semver.ranges import max_satisfying, satisfies
from semver.version import Version, bump, compare, parse, sort_versions

__all__ = ["Version", "bump", "compare", "max_satisfying", "parse", "satisfies", "sort_versions"]
