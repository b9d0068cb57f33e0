"""The socket side of the server: the ROUTER loop (``router``)."""
