"""An object that pickles but does not load, for the tests of the launchers' call channels (a test module
imports no other test module: this one is shared)."""


def _cannot_load():
    raise ModuleNotFoundError("No module named 'notebook_cell'")


class LoadsNowhere:
    """Pickles, but does not load: as a class of the sender's ``__main__`` in another process."""

    def __reduce__(self):
        return _cannot_load, ()
