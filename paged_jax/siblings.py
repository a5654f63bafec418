"""The project's other top-level packages, `kernels_pallas` and `models`, found beside paged_jax itself.

Their names are common words: the folder a user works in often holds a `models/` folder (weights), the
folder of a user's script a `models.py`. Python searches sys.path in order, and the script's folder (for
`python -c`, the working directory) comes first, so a `models.py` there shadows the project's package;
the finder of an editable install (`pip install -e .`) even runs after the whole path search, so a bare
`models/` folder, a namespace package, wins as well. Importing paged_jax puts a finder at the head of
sys.meta_path that resolves exactly these two names to the folders beside paged_jax, before any path
entry is searched: a wheel, an editable install in any mode and a checkout all give paged_jax its own.

The names are the price. After `import paged_jax` a user's own `models.py` cannot be imported as
`models` in the same process (sys.modules holds one module per name); one imported before paged_jax
makes importing paged_jax fail, naming the file to rename.
"""

import importlib.abc
import importlib.machinery
import sys
from pathlib import Path

PACKAGES = ("kernels_pallas", "models")
# Not resolved: in an editable install's link tree (strict mode) the siblings are links beside ours.
ROOT = Path(__file__).parent.parent


class _SiblingFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name in PACKAGES:
            return importlib.machinery.PathFinder.find_spec(name, [str(ROOT)])
        return None  # any other name: the usual search


def _is_ours(module, name: str) -> bool:
    file = getattr(module, "__file__", None)  # None for a namespace package (a folder without __init__.py)
    return file is not None and Path(file).resolve() == (ROOT / name / "__init__.py").resolve()


def install() -> None:
    """Resolve PACKAGES to the project's own from now on; ImportError if another module already holds a name."""
    for name in PACKAGES:
        module = sys.modules.get(name)
        if module is not None and not _is_ours(module, name):
            where = getattr(module, "__file__", None) or list(getattr(module, "__path__", [])) or module
            raise ImportError(f"a module named {name!r} is already imported from {where}, not paged-jax's own "
                              f"package of that name ({ROOT / name}): rename yours")
    if not any(isinstance(finder, _SiblingFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _SiblingFinder())
