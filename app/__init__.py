"""The application on top of the components: the `fleetrl` CLI, the launchers, the config checks that know
components, and the wiring that hands one component's code to another (docs/architecture.md)."""
