"""hmaclient: the client library of hmad (arrives with the daemon)."""
