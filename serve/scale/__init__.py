"""Scale-out: more than one engine behind one address.

ray_app.py             Ray Serve deployment of replicas (replica_pool.py) behind one ingress
prefix_router.py       routes a request to the replica that holds its prefix
autoscale.py           the SLO autoscaler (autoscale_args.py: its CLI flags)
disagg_proxy.py        the prefill/decode disaggregation proxy (balancer.py picks the instance)
"""
