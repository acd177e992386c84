"""ethercat-loop: a Shadow Dexterous Hand palm over EtherCAT (protocol 0220/0230) on MQTT. See README.md."""
