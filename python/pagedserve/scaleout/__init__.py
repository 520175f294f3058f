"""Scale-out across PagedServe replicas: request routing (router.py, plain
Python: routers know replicas only by what they report) and `pagedserve serve
--replicas N` on Ray Serve (ray_app.py, ray_router.py, asgi_forward.py;
imported only with --replicas, so Ray stays optional)."""
