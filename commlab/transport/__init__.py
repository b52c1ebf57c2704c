"""Moving bytes between processes: the wire format, sockets (zmq, CURVE), shared memory,
the parameter-server protocol, rendezvous and the job's store."""
