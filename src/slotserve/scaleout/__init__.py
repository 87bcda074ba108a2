"""Scale out: engine replicas on Ray Serve behind a cache- and load-aware router.

`router` is pure Python; `replica`, `front` and `launch` (entered by `slotserve serve
--replicas N`) need the `ray` extra and import Ray only when used.
"""
