"""Fresh data before every timed call, the same on the torch and the MPI side.

``fresh(run, view)`` returns a call that first rewrites ``view`` (a numpy
array over what this rank contributes) with zeros, then runs ``run()``: each
call then finds this rank's contribution just written, as a training step's
new values are, instead of the unchanged buffer a single-copy reader (Open
MPI's) would find in its own cache from the call before. ``view`` None (a
rank that contributes nothing, a broadcast's non-root) leaves ``run`` as is.
Used by collectives.py and mpi_collectives.py, so that both sides time the
same fill.
"""


def fresh(run, view):
    if view is None:
        return run
    view = view.view("uint8")

    def fresh_run():
        view.fill(0)
        run()

    return fresh_run
