"""The processes of a job: what ``setup_environment`` runs, and what ends them.

* :mod:`launchers`: which launcher started the process (torchrun, srun, mpirun, jsrun) and what it started;
  :mod:`rank_placement`: that the ranks sit node by node as the mesh assumes.
* :mod:`distributed`: the default process group; :mod:`process_group_strategy`: Fabric's hooks around it.
* :mod:`run_topology`: the strategy's :class:`~fabric_hsdp.topology.Topology` and mesh from its arguments (``"auto"``
  asks the planner).
* :mod:`failures`: how an error ends the script (one line for the job).
* :mod:`preemption`: a signal turned into a last save; :mod:`teardown`: process groups closed at the end.
"""
