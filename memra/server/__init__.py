"""The serving layer: request scheduling and the HTTP front end."""
