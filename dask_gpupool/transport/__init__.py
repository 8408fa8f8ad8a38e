"""Transport: the fd broker (server), the peer link (client) and the streamed copy, over Unix and TCP sockets."""
