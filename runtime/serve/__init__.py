"""HTTP serving: the OpenAI-compatible server (:mod:`.server`) and Ray Serve scale-out (:mod:`.ray_serve`).

Needs the ``[serve]`` extra (FastAPI, uvicorn); Ray only for :mod:`.ray_serve`.
"""
