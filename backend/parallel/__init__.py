"""The ranks of one model instance: rank 0 and its worker processes (group.py), each building its shard through
backend/deployment.py. How the model is split over the ranks and the collectives its forward calls are the model's
(backend/model/parallel_layout.py, backend/model/comm.py), so the model never imports this package."""
