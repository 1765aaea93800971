"""hal's applications: what runs *on* the API and the consumers, never imported by them.

Layers (imports point down only; ``tests/test_layers.py`` checks it):

* ``hal.apps`` (this package): the ``hal`` command line (``cli``), the weight-sync job, the benchmarks;
  they may import ``hal``, ``engines``, ``ckpt`` and ``devices``.
* ``engines``, ``ckpt``: consumers of the API.
* ``hal`` (every module outside ``hal.apps``): the API; imports ``devices`` only.
* ``devices``: hardware knowledge; imports nothing from the packages above.
"""
