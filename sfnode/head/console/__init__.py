"""The operator's console (docs/api.md "The console"): what the head shows of its fleet, live.

``record`` keeps what only the HTTP layer sees (first-token times and tokens delivered per
model, 429s per client, resumed streams), ``series`` the small time series the page plots,
``state`` builds the snapshot (``/console/state``) from the fleet's own objects on demand,
``feed`` sends it to the viewers of ``/console/feed`` while there are any, and ``page.html`` is
the page itself (package data: no asset is fetched from anywhere else).  The HTTP resources that
serve them are in ``sfnode.head.api.console``.

May import ``sfnode.head.fleet``, ``sfnode.head.link``, ``sfnode.head.models``,
``sfnode.linkf``, ``sfnode.runtime`` and ``sfnode.generation``; never the HTTP API above it.
"""
