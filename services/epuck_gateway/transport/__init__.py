"""The links to the robots, one per robot on the gateway's loop, with one surface whichever way a robot is reached:
`wifi` (`EpuckLink`, TCP to the radio module), `serial` (`EpuckSerialLink`, asercom v2 over Bluetooth or USB), and
`base`, what both share (the stats, the callbacks, the supervisor's reports, the factories' hooks); both links run
under the kit's reconnect loop (shared/transport.py). `liveness` is the WiFi link's allowed silence."""
