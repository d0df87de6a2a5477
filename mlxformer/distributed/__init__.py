"""Generation across several processes or machines with ``mx.distributed`` (started by
``mlx.launch``): pipeline parallel (``pipeline``), tensor parallel (``tensor``), each rank
loading only its share (through ``formats.checkpoint``), with a watchdog so a lost rank ends every rank
(``group``, ``watchdog``)."""
