"""roi-modules: ROI GPIO, ODrive and actuator modules over UDP."""
