// Pre-heat (issue 11): a voucher created START_IN seconds before its sale starts, under a
// constant arrival rate of distinct customers from before the start until RUN seconds into the
// sale (reserves before the start get 422 NOT_STARTED). With pre-heat every node holds a lease
// when the sale opens, so its first second should be served like its tenth.
// scripts/first-second.sh runs it with --out json and prints the p99 of 201s per second of sale.
import http from 'k6/http';
import exec from 'k6/execution';
import { fail } from 'k6';
import { BASES, JSON_HEADERS, TOKEN } from './lib.js';

const START_IN = parseInt(__ENV.START_IN || '10', 10);
const RUN = parseInt(__ENV.RUN || '11', 10);
const RATE = parseInt(__ENV.RATE || '2000', 10);

export const options = {
  scenarios: {
    sale: {
      executor: 'constant-arrival-rate',
      rate: RATE,
      timeUnit: '1s',
      duration: `${START_IN + RUN}s`,
      preAllocatedVUs: 100,
      maxVUs: 500,
    },
  },
  discardResponseBodies: true,
};

export function setup() {
  const code = `FIRST-${Date.now().toString(36)}`;
  const startsAt = new Date(Date.now() + START_IN * 1000).toISOString();
  const body = {
    code, discountAmount: 1000, minOrderAmount: 0, totalLimit: 100000000, perUserLimit: 1,
    startsAt, endsAt: '2099-01-01T00:00:00Z',
  };
  const res = http.post(`${BASES[0]}/admin/vouchers`, JSON.stringify(body), {
    headers: Object.assign({ Authorization: `Bearer ${TOKEN}` }, JSON_HEADERS),
    tags: { kind: 'setup' },
  });
  if (res.status !== 201) fail(`create voucher: ${res.status} ${res.body}`);
  return { code };
}

export default function (data) {
  const i = exec.scenario.iterationInTest + 1;
  const base = BASES[i % BASES.length];
  http.post(
    `${base}/vouchers/${data.code}/reservations`,
    JSON.stringify({ customerId: i, orderId: `${data.code}-${i}`, orderAmount: 5000 }),
    { headers: JSON_HEADERS, tags: { kind: 'reserve' } },
  );
}
