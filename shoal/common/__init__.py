"""What both sides share: wire types, identities and signing, tickets, certificates, TLS
channels, errors and status codes, limits, health and metrics. Imports neither
`shoal.peer` nor `shoal.coordinator`."""
