// A robobus client in TypeScript, on the models generated from docs/asyncapi.yaml (`npm run generate`).
//
//   1. lists the nodes from their retained `{root}/{node}/status` messages (and their devices' health),
//   2. reads one e-puck's sensors from `{root}/{node}/{device}/state/sensors` as an EpuckSensors,
//   3. sends `set_speed` with MQTT 5 request/response (Response Topic + Correlation Data) and prints
//      the typed reply (EpuckActuatorsOrError: EpuckActuatorsOk | ErrorReply),
//   4. handles error replies by their code (an out-of-range speed, a device that does not exist),
//   5. stops the robot again.
//
// Usage: node dist/client.js [--url mqtt://127.0.0.1:1883] [--root robobus] [--timeout-ms 10000]
// The last line printed is one JSON object summing up what happened (the test suite reads it).

import { randomBytes } from 'node:crypto';
import { connectAsync, type IPublishPacket, type MqttClient } from 'mqtt';

import type { EpuckActuators } from './models/EpuckActuators';
import type { EpuckActuatorsOrError } from './models/EpuckActuatorsOrError';
import type { EpuckSensors } from './models/EpuckSensors';
import type { EpuckSetSpeed } from './models/EpuckSetSpeed';
import type { ErrorCode } from './models/ErrorCode';
import type { ErrorReply } from './models/ErrorReply';
import type { Health } from './models/Health';
import type { Status } from './models/Status';

interface Options { url: string; root: string; timeoutMs: number }

function options(argv: string[]): Options {
  const opts: Options = { url: process.env.ROBOBUS_MQTT_URL ?? 'mqtt://127.0.0.1:1883',
    root: process.env.ROBOBUS_TOPIC_ROOT ?? 'robobus', timeoutMs: 10_000 };
  for (let i = 0; i < argv.length; i += 2) {
    const [flag, value] = [argv[i], argv[i + 1]];
    if (value === undefined) throw new Error(`${flag} needs a value`);
    if (flag === '--url') opts.url = value;
    else if (flag === '--root') opts.root = value;
    else if (flag === '--timeout-ms') opts.timeoutMs = Number(value);
    else throw new Error(`unknown option ${flag}`);
  }
  return opts;
}

/** Does an MQTT topic filter (with + and #) match a topic? */
function matches(filter: string, topic: string): boolean {
  const f = filter.split('/');
  const t = topic.split('/');
  for (let i = 0; i < f.length; i++) {
    if (f[i] === '#') return true;
    if (i >= t.length || (f[i] !== '+' && f[i] !== t[i])) return false;
  }
  return f.length === t.length;
}

/** Subscribe, and collect the latest message of each topic on `filter` until `done` says enough (or
 * time runs out). The broker sends the retained messages at once after the subscription: `settleMs`
 * more lets the rest of that burst in (every node's status, not only the first one we wanted). */
async function collect<T>(client: MqttClient, filter: string, timeoutMs: number,
  done: (got: Map<string, T>) => boolean, settleMs = 300): Promise<Map<string, T>> {
  const got = new Map<string, T>();
  return new Promise((resolve, reject) => {
    let timer = setTimeout(() => finish(), timeoutMs);
    let settling = false;
    const onMessage = (topic: string, payload: Buffer): void => {
      if (!matches(filter, topic) || payload.length === 0) return;
      got.set(topic, JSON.parse(payload.toString('utf8')) as T);
      if (!settling && done(got)) {
        settling = true;
        clearTimeout(timer);
        timer = setTimeout(() => finish(), settleMs);
      }
    };
    const finish = (): void => {
      clearTimeout(timer);
      client.removeListener('message', onMessage);
      client.unsubscribeAsync(filter).then(() => resolve(got), reject);
    };
    client.on('message', onMessage);
    client.subscribeAsync(filter, { qos: 1 }).catch(reject);
  });
}

/** A command with MQTT 5 request/response: the reply comes on our Response Topic, matched to the
 * request by its Correlation Data. */
class Commands {
  private readonly pending = new Map<string, (payload: Buffer) => void>();

  constructor(private readonly client: MqttClient, readonly replyTopic: string) {
    client.on('message', (topic: string, payload: Buffer, packet: IPublishPacket) => {
      const id = packet.properties?.correlationData?.toString('hex');
      if (topic !== this.replyTopic || id === undefined) return;
      this.pending.get(id)?.(payload);
      this.pending.delete(id);
    });
  }

  async start(): Promise<void> {
    await this.client.subscribeAsync(this.replyTopic, { qos: 1 });
  }

  async call<Reply>(commandTopic: string, request: object, timeoutMs: number): Promise<Reply> {
    const correlation = randomBytes(8);
    const reply = new Promise<Buffer>((resolve, reject) => {
      const timer = setTimeout(() => {
        this.pending.delete(correlation.toString('hex'));
        reject(new Error(`no reply to ${commandTopic} within ${timeoutMs} ms`));
      }, timeoutMs);
      this.pending.set(correlation.toString('hex'), (payload) => { clearTimeout(timer); resolve(payload); });
    });
    // The request's age is the time we wait for its reply: a node that reads it later answers `expired` and never
    // runs it (robobus-deadline: Unix ms; the Message Expiry Interval lets the broker drop it too).
    await this.client.publishAsync(commandTopic, JSON.stringify(request), {
      qos: 1, properties: { responseTopic: this.replyTopic, correlationData: correlation,
                            messageExpiryInterval: Math.ceil(timeoutMs / 1000),
                            userProperties: { 'robobus-deadline': String(Date.now() + timeoutMs) } },
    });
    return JSON.parse((await reply).toString('utf8')) as Reply;
  }
}

/** What a client does about each error code. The switch is exhaustive over ErrorCode: when the
 * contract gains a code, this stops compiling until the new code is handled. */
function advice(code: ErrorCode): string {
  switch (code) {
    case 'invalid_request': return 'the request is wrong: fix it, do not retry';
    case 'not_found': return 'no such device, command or job on that node';
    case 'unavailable': return 'the device is not connected or not operational: retry later';
    case 'busy': return 'held by another request or job: retry later';
    case 'timeout': return 'the device did not answer in time: retry';
    case 'device_error': return 'the device refused: see the message';
    case 'forbidden': return 'not allowed';
    case 'internal': return 'a bug in the service: report it';
    case 'stopped': return 'the bus stop is active: motion waits for `robobus stop --release`, then a new command';
    case 'expired': return 'the node read the request after its age: not executed; send a fresh one';
    case 'cancelled': return 'the job was cancelled by request';
    default: {
      const unhandled: never = code;
      return unhandled;
    }
  }
}

function isError(reply: EpuckActuatorsOrError): reply is ErrorReply {
  return 'error' in reply;
}

async function main(): Promise<void> {
  const opts = options(process.argv.slice(2));
  const clientId = `robobus-example-ts-${process.pid}`;
  const client = await connectAsync(opts.url, { protocolVersion: 5, clientId, clean: true, reconnectPeriod: 0 });
  try {
    // 1. Nodes: every node's status is retained; wait until an online e-puck gateway is among them.
    const statuses = await collect<Status>(client, `${opts.root}/+/status`, opts.timeoutMs,
      (got) => [...got.values()].some((s) => s.online && s.service === 'epuck-gateway'));
    for (const s of [...statuses.values()].sort((a, b) => a.node.localeCompare(b.node))) {
      console.log(`node ${s.node} (${s.service} ${s.version}): ${s.online ? 'online' : `offline, ${s.reason ?? ''}`}`
        + ` devices ${(s.devices ?? []).join(', ')}`);
    }
    const gateway = [...statuses.values()].find((s) => s.online && s.service === 'epuck-gateway');
    if (gateway === undefined) throw new Error('no online epuck-gateway node');
    const node = `${opts.root}/${gateway.node}`;

    // Pick a robot whose health says it is connected (health is retained too).
    const healths = await collect<Health>(client, `${node}/+/health`, opts.timeoutMs,
      (got) => [...got.values()].some((h) => h.connection && h.operational));
    const robot = [...healths.values()].find((h) => h.connection && h.operational);
    if (robot === undefined) throw new Error(`no connected robot on ${gateway.node}`);
    console.log(`robot ${robot.device}: ${robot.state}`);

    // 2. Sensors, typed by the generated model.
    const sensorsTopic = `${node}/${robot.device}/state/sensors`;
    const sensors = (await collect<EpuckSensors>(client, sensorsTopic, opts.timeoutMs, (got) => got.size > 0, 0))
      .get(sensorsTopic);
    if (sensors === undefined) throw new Error(`no sensors on ${sensorsTopic}`);
    console.log(`sensors #${sensors.seq}: battery ${sensors.battery_v.toFixed(2)} V, `
      + `proximity [${sensors.proximity.join(' ')}], steps ${sensors.steps.left}/${sensors.steps.right}`);

    // 3. set_speed with MQTT 5 request/response; the reply is the typed union.
    const commands = new Commands(client, `${opts.root}/_client/${clientId}/reply`);
    await commands.start();
    const setSpeed = (device: string, request: EpuckSetSpeed): Promise<EpuckActuatorsOrError> =>
      commands.call<EpuckActuatorsOrError>(`${node}/${device}/cmd/set_speed`, request, opts.timeoutMs);
    const reply = await setSpeed(robot.device, { left: 200, right: -200 });
    if (isError(reply)) throw new Error(`set_speed failed: ${reply.error.code}: ${reply.error.message}`);
    const actuators: EpuckActuators = reply.result;
    console.log(`set_speed ok: left ${actuators.left_speed}, right ${actuators.right_speed}`);

    // 4. Error replies, handled by their code.
    const errors: Record<string, ErrorCode> = {};
    const attempts: Array<[string, string, EpuckSetSpeed]> = [
      ['out_of_range', robot.device, { left: 5000, right: 0 }],
      ['unknown_device', 'no-such-robot', { left: 0, right: 0 }],
    ];
    for (const [what, device, request] of attempts) {
      const r = await setSpeed(device, request);
      if (!isError(r)) throw new Error(`${what}: expected an error reply, got ${JSON.stringify(r)}`);
      errors[what] = r.error.code;
      console.log(`${what}: ${r.error.code} (${advice(r.error.code)}): ${r.error.message}`);
    }

    // 5. Leave the robot stopped.
    const stop = await setSpeed(robot.device, { left: 0, right: 0 });
    if (isError(stop)) throw new Error(`stop failed: ${stop.error.code}`);

    console.log(JSON.stringify({
      nodes: [...statuses.values()].map((s) => ({ node: s.node, service: s.service, online: s.online })),
      device: robot.device, sensors_seq: sensors.seq,
      set_speed: { left_speed: actuators.left_speed, right_speed: actuators.right_speed },
      errors, stopped: { left_speed: stop.result.left_speed, right_speed: stop.result.right_speed },
    }));
  } finally {
    await client.endAsync();
  }
}

main().catch((err: unknown) => {
  console.error(`error: ${err instanceof Error ? err.message : String(err)}`);
  process.exit(1);
});
