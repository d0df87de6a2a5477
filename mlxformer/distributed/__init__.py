"""Generation across several processes or machines with ``mx.distributed`` (started by
``mlx.launch``), each rank loading only its share (through ``formats.checkpoint``).

- ``group.py``: the process group (ring over TCP, JACCL or MPI as available).
- ``pipeline.py``: pipeline parallel, consecutive layers on each rank.
- ``tensor.py``: tensor parallel, every layer split by attention heads and MLP columns.
- ``runner.py``: a model loaded across the ranks and generated with; rank 0 gets the responses.
- ``watchdog.py``: ends the process when a wait for another rank lasts too long, so a lost
  rank ends every rank."""
