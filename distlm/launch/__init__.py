"""Who am I in the job? Rank, world size, local rank, node and master address, from the launcher.

``detect_launch()`` (detect.py) asks each launcher in a fixed order -- torchrun
(torchrun.py), Slurm's srun (slurm.py), MPI's mpiexec (mpi.py: OpenMPI, then MPICH/Intel
MPI), then plain ``RANK``/``WORLD_SIZE`` exports (env_vars.py: ``env://``, a Kubeflow
PyTorchJob, one process per host) -- and the first that recognises its variables
describes this process as a ``ClusterEnv`` (cluster_env.py). fairseq-style flags
(``--distributed-rank`` and friends, explicit.py) come next: they fill in a launch nobody
else describes, or must agree with the launcher that does. Nothing at all means one process.

``RANK`` and ``WORLD_SIZE`` are read by several launchers, so they are checked first
(``check_rank_variables``): set by hand next to srun's or mpiexec's own variables they
must agree with them, and alone they must come together.

Each launcher is a small class with a static ``detect(environ)`` that returns a
``ClusterEnv`` or ``None``, so adding a launcher never touches another one's rules
(Lightning Fabric's ``plugins/environments``; fairseq's ``infer_init_method`` mixes all
launchers in one function, which is what this layout avoids). hosts.py finds which ranks
share a host, devices.py which device a local rank uses.

Layer: reads the environment only, before torch is imported. It may import ``distlm.errors``
and nothing else of distlm (mpi4py only inside the MPI functions that need it).
"""
