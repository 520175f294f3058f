"""Scale-out across PagedServe replicas: request routing (router.py). The Ray
Serve application that runs replicas behind one endpoint is planned (issue 29);
the routers here are plain Python and know replicas only by what they report."""
